pub mod apply;
pub mod avb;
pub mod inspect;
pub mod verity;
