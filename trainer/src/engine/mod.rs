//! The CPU training engine (being built).
