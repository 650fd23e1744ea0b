//! The C layouts the provider shares with libibverbs, in one place.
//!
//! - [`verbs`]: public structs of `<infiniband/verbs.h>`; `tests/abi_layout.rs` compiles a C
//!   program against the system header and compares every offset and size used here.
//! - [`driver`]: rdma-core's private provider structs (`driver.h`, not shipped by any package)
//!   as rdma-core 36..=58 lay them out (the structs this crate touches are textually identical
//!   across those releases but for one field `ibv_port_attr` gained at its end in 49; 35 and
//!   59 differ). [`version`] refuses to register with any other libibverbs.

pub mod driver;
pub mod verbs;
pub mod version;
