pub mod apply;
pub mod avb;
pub mod cleanup;
pub mod diff;
pub mod inspect;
pub mod merge;
pub mod serve;
pub mod verity;
