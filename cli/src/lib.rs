//! The `xroce` command's library: everything the binary does, importable by tests.

pub mod capture;
pub mod engine;
pub mod exec;
pub mod link;
pub mod pcap_check;
