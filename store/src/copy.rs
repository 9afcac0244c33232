//! copy (in progress).
