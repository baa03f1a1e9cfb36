//! `ninfer`: the command-line front end.
fn main() {}
