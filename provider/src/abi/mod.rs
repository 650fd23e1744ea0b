//! The C layouts the provider shares with libibverbs, in one place.
//!
//! - [`verbs`]: public structs of `<infiniband/verbs.h>`; `tests/abi_layout.rs` compiles a C
//!   program against the system header and compares every offset and size used here.
//! - [`driver`]: rdma-core's private provider structs (`driver.h`, not shipped by any package)
//!   for the `IBVERBS_PRIVATE_34` ABI as rdma-core 36..=48 lay them out (the structs this crate
//!   touches are textually identical across those releases; 35 and 49 differ). [`version`]
//!   refuses to register with any other libibverbs.

pub mod driver;
pub mod verbs;
pub mod version;
