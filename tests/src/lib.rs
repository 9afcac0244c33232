//! kiln-tests: helpers shared by the integration tests in `tests/tests/`, which run against
//! the real servers that `ci/setup.sh` starts on 127.0.0.1.

pub mod crash;
pub mod fault_proxy;
pub mod stores;
