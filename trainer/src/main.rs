//! `ringmaster-trainer`: see `--help`.

fn main() {
    println!("ringmaster-trainer {}", env!("CARGO_PKG_VERSION"));
}
