//! The warmstart node agent: node engine (CRIU, CUDA, container runtimes) and local CLI.
#![deny(unsafe_code)]
