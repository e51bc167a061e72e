pub mod apply;
pub mod inspect;
