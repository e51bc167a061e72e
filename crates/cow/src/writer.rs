pub struct CowWriter; pub struct WriterOptions; pub struct CowSizeInfo;
