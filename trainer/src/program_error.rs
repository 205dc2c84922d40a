//! The failure of a program that does not print the contract's failure line (a user's own
//! program under `launch`, such as a PyTorch script): read from what its ranks wrote on
//! stderr, which `mpirun` gathers on its own. Python's words for an exception are the last
//! line of its traceback (`ValueError: …`); the cause is the first such line that is not a
//! lost peer's (the ranks a failing rank takes down say "Connection closed by peer" after
//! it), and its rank the one Open MPI's report names as the first to exit non-zero.

use ringmaster_contract::trainer::{Failure, exit};

/// What a line of stderr ends with when a peer went away: the symptom on the ranks a
/// failing rank takes down (gloo's, NCCL's and the socket's words), never the cause.
const LOST_PEER_WORDS: [&str; 6] = [
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "communicator was aborted",
    "Socket Timeout",
    "DistNetworkError",
];

/// Where the reader is in Python's traceback format.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
enum Traceback {
    #[default]
    Outside,
    /// Between `Traceback (most recent call last):` and its exception line (frames are
    /// indented).
    Frames,
}

/// The error lines the ranks' stderr held, line by line ([`ProgramError::read`]).
#[derive(Debug, Default)]
pub struct ProgramError {
    traceback: Traceback,
    /// The next exception line replaces the last one: Python said the last one was handled
    /// into (or caused) another.
    chained: bool,
    /// Each traceback's exception line, in the order they came.
    exceptions: Vec<String>,
    /// The rank Open MPI's report names as the first process to exit non-zero.
    first_failed_rank: Option<u64>,
}

impl ProgramError {
    /// Takes one line of the ranks' stderr.
    pub fn read(&mut self, line: &str) {
        let line = line.trim_end();
        if self.first_failed_rank.is_none() {
            self.first_failed_rank = open_mpi_failed_rank(line);
        }
        if line.starts_with("Traceback (most recent call last):") {
            self.traceback = Traceback::Frames;
            return;
        }
        if line.starts_with("During handling of the above exception")
            || line.starts_with("The above exception was the direct cause")
        {
            self.chained = true;
            return;
        }
        let frame = line.starts_with([' ', '\t']) || line.is_empty();
        if self.traceback == Traceback::Frames && !frame {
            if self.chained {
                self.exceptions.pop();
                self.chained = false;
            }
            self.exceptions.push(line.to_string());
            self.traceback = Traceback::Outside;
        }
    }

    /// The failure to report when the launcher is to leave with `code`: the cause's
    /// exception line, for a program's own failure (codes 1–127 but a lost peer's). None for
    /// success, for a rank killed by a signal or a lost peer (`mpirun`'s own report, in the
    /// log's tail, says which), and when no traceback was seen.
    pub fn failure(&self, code: u8) -> Option<Failure> {
        if code == exit::SUCCESS || code == exit::PEER_LOST || code >= 128 {
            return None;
        }
        let lost_peer = |line: &&String| LOST_PEER_WORDS.iter().any(|w| line.contains(w));
        let cause = self
            .exceptions
            .iter()
            .find(|line| !lost_peer(line))
            .or(self.exceptions.first())?;
        Some(Failure {
            rank: self.first_failed_rank,
            error: cause.clone(),
            exit_code: code,
        })
    }
}

/// The rank in Open MPI's report of the first process that exited non-zero:
/// `  Process name: [[12854,1],3]` → 3 (its vpid, which is the rank in `MPI_COMM_WORLD`).
fn open_mpi_failed_rank(line: &str) -> Option<u64> {
    let name = line.trim().strip_prefix("Process name: [[")?;
    let (_, rank) = name.split_once("],")?;
    rank.strip_suffix(']')?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> ProgramError {
        let mut error = ProgramError::default();
        text.lines().for_each(|line| error.read(line));
        error
    }

    /// What Open MPI's `mpirun` gathered when rank 1 of four raised and the others lost it
    /// in a barrier (Debian's PyTorch 1.13 with gloo, run here).
    const RANK_1_RAISED: &str = "\
Traceback (most recent call last):
  File \"/tmp/raise.py\", line 4, in <module>
    raise ValueError(\"the labels have 3 classes, the model 10\")
ValueError: the labels have 3 classes, the model 10
Traceback (most recent call last):
  File \"/tmp/raise.py\", line 5, in <module>
    dist.barrier()
  File \"/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py\", line 3152, in barrier
    work.wait()
RuntimeError: [./gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:14221
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[12854,1],1]
  Exit code:    1
--------------------------------------------------------------------------";

    #[test]
    fn the_raising_ranks_exception_line_is_the_failure() {
        let failure = read(RANK_1_RAISED).failure(1).expect("a failure");
        assert_eq!(
            failure.to_string(),
            "rank 1: ValueError: the labels have 3 classes, the model 10"
        );
        assert_eq!(failure.exit_code, 1);
    }

    #[test]
    fn a_lost_peers_exception_is_passed_over_even_when_it_came_first() {
        let peer_first = "Traceback (most recent call last):\n  File \"x.py\", line 5\nRuntimeError: Connection reset by peer\nTraceback (most recent call last):\n  File \"x.py\", line 9\nKeyError: 'label'\n";
        let failure = read(peer_first).failure(1).unwrap();
        assert_eq!(failure.error, "KeyError: 'label'");
        assert_eq!(failure.rank, None, "no Open MPI report: no rank");
        // Only lost peers: the first is still better than nothing.
        let only = read("Traceback (most recent call last):\n  x\nRuntimeError: Broken pipe\n");
        assert_eq!(only.failure(1).unwrap().error, "RuntimeError: Broken pipe");
    }

    #[test]
    fn a_chained_exception_reports_the_last_of_its_chain() {
        let chained = "Traceback (most recent call last):\n  File \"x.py\", line 2\nKeyError: 'a'\n\nDuring handling of the above exception, another exception occurred:\n\nTraceback (most recent call last):\n  File \"x.py\", line 4\nValueError: no label a\n";
        assert_eq!(
            read(chained).failure(1).unwrap().error,
            "ValueError: no label a"
        );
    }

    #[test]
    fn signals_lost_peers_success_and_no_traceback_report_nothing() {
        let error = read(RANK_1_RAISED);
        for code in [0, exit::PEER_LOST, 137] {
            assert_eq!(error.failure(code), None, "code {code}");
        }
        let plain =
            read("ssh: connect to host w-0 port 2222: Connection refused\nerror: no such file\n");
        assert_eq!(plain.failure(1), None);
    }

    #[test]
    fn open_mpis_report_names_the_rank() {
        assert_eq!(
            open_mpi_failed_rank("  Process name: [[12854,1],3]"),
            Some(3)
        );
        assert_eq!(open_mpi_failed_rank("  Exit code:    1"), None);
        assert_eq!(open_mpi_failed_rank("  Process name: [[1,1],x]"), None);
    }
}
