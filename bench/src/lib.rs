//! xroce benchmarks. The criterion micro-benchmarks are in `benches/`; the side-by-side
//! comparisons against raw AF_XDP, kernel sockets and rdma_rxe come with the datapath.
