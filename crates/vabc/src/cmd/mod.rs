pub mod apply;
pub mod avb;
pub mod inspect;
pub mod merge;
pub mod verity;
