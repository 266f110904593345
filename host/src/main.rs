//! The `kvplane` binary: a thin shell over the library's capabilities.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
