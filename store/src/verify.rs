//! verify (in progress).
