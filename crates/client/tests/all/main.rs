//! The client against a real node, in this process, on loopback: one test
//! binary, a module per path.

mod put_path;
mod read_path;
