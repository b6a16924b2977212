//! The client side of the "GPU": device memory lives in the test harness's device server,
//! reached over a connected unix socket (`device.sock`). While a workload holds that
//! connection, CRIU refuses to dump it (a stream socket whose peer is outside the dumped
//! tree), as it refuses a real GPU workload's `/dev/nvidia*` mappings; a CUDA checkpoint
//! copies device memory into the process and closes the connection.
//!
//! Wire format (little-endian): a request is `op: u8, ptr: u64, len: u64` then `len` bytes
//! for a write; the answer is `status: u8` then `len` bytes for a read. Ops: 1 alloc, 2 write,
//! 3 read, 4 free. Status 0 is success; anything else a bad address or size.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

/// `alloc`.
pub const OP_ALLOC: u8 = 1;
/// `write`.
pub const OP_WRITE: u8 = 2;
/// `read`.
pub const OP_READ: u8 = 3;
/// `free`.
pub const OP_FREE: u8 = 4;

/// A connection to the device server.
#[derive(Debug)]
pub struct Device {
    stream: UnixStream,
}

impl Device {
    /// Connects to `device.sock` in the state directory.
    pub fn connect() -> std::io::Result<Self> {
        let dir = crate::config::dir()
            .ok_or_else(|| std::io::Error::other("no stand-in state directory"))?;
        Ok(Self {
            stream: UnixStream::connect(dir.join("device.sock"))?,
        })
    }

    fn request(&mut self, op: u8, ptr: u64, len: u64, data: &[u8]) -> std::io::Result<()> {
        let mut header = [0u8; 17];
        header[0] = op;
        header[1..9].copy_from_slice(&ptr.to_le_bytes());
        header[9..17].copy_from_slice(&len.to_le_bytes());
        self.stream.write_all(&header)?;
        self.stream.write_all(data)?;
        let mut status = [0u8; 1];
        self.stream.read_exact(&mut status)?;
        if status[0] == 0 {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "device refused op {op} at {ptr:#x}+{len}"
            )))
        }
    }

    /// Reserves `len` bytes at `ptr`.
    pub fn alloc(&mut self, ptr: u64, len: u64) -> std::io::Result<()> {
        self.request(OP_ALLOC, ptr, len, &[])
    }

    /// Writes at `ptr` (inside one allocation).
    pub fn write(&mut self, ptr: u64, data: &[u8]) -> std::io::Result<()> {
        self.request(OP_WRITE, ptr, data.len() as u64, data)
    }

    /// Reads into `out` from `ptr` (inside one allocation).
    pub fn read(&mut self, ptr: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.request(OP_READ, ptr, out.len() as u64, &[])?;
        self.stream.read_exact(out)
    }

    /// Releases the allocation at `ptr`.
    pub fn free(&mut self, ptr: u64) -> std::io::Result<()> {
        self.request(OP_FREE, ptr, 0, &[])
    }
}
