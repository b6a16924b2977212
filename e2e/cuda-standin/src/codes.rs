//! `CUresult` values the stand-in answers with (from `cuda.h`). Which code the real driver
//! returns for a non-zero reserved byte, a restore without `cuInit` and a lock timeout is
//! unconfirmed; these are the plausible ones.
#![allow(missing_docs)]

pub const CUDA_SUCCESS: i32 = 0;
pub const CUDA_ERROR_INVALID_VALUE: i32 = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: i32 = 3;
pub const CUDA_ERROR_NO_DEVICE: i32 = 100;
pub const CUDA_ERROR_INVALID_DEVICE: i32 = 101;
pub const CUDA_ERROR_INVALID_IMAGE: i32 = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: i32 = 201;
pub const CUDA_ERROR_OPERATING_SYSTEM: i32 = 304;
pub const CUDA_ERROR_ILLEGAL_STATE: i32 = 401;
pub const CUDA_ERROR_TIMEOUT: i32 = 909;
pub const CUDA_ERROR_UNKNOWN: i32 = 999;

/// `cuGetErrorName` / `cuGetErrorString` text (NUL-terminated, static).
pub fn text(code: i32) -> Option<(&'static [u8], &'static [u8])> {
    Some(match code {
        CUDA_SUCCESS => (b"CUDA_SUCCESS\0", b"no error\0"),
        CUDA_ERROR_INVALID_VALUE => (b"CUDA_ERROR_INVALID_VALUE\0", b"invalid argument\0"),
        CUDA_ERROR_OUT_OF_MEMORY => (b"CUDA_ERROR_OUT_OF_MEMORY\0", b"out of memory\0"),
        CUDA_ERROR_NOT_INITIALIZED => (b"CUDA_ERROR_NOT_INITIALIZED\0", b"initialization error\0"),
        CUDA_ERROR_NO_DEVICE => (
            b"CUDA_ERROR_NO_DEVICE\0",
            b"no CUDA-capable device is detected\0",
        ),
        CUDA_ERROR_INVALID_DEVICE => (b"CUDA_ERROR_INVALID_DEVICE\0", b"invalid device ordinal\0"),
        CUDA_ERROR_INVALID_IMAGE => (
            b"CUDA_ERROR_INVALID_IMAGE\0",
            b"device kernel image is invalid\0",
        ),
        CUDA_ERROR_INVALID_CONTEXT => {
            (b"CUDA_ERROR_INVALID_CONTEXT\0", b"invalid device context\0")
        }
        CUDA_ERROR_OPERATING_SYSTEM => (
            b"CUDA_ERROR_OPERATING_SYSTEM\0",
            b"OS call failed or operation not supported on this OS\0",
        ),
        CUDA_ERROR_ILLEGAL_STATE => (
            b"CUDA_ERROR_ILLEGAL_STATE\0",
            b"operation not permitted in the current state\0",
        ),
        CUDA_ERROR_TIMEOUT => (CUDA_TIMEOUT_NAME, b"the wait operation has timed out\0"),
        CUDA_ERROR_UNKNOWN => (b"CUDA_ERROR_UNKNOWN\0", b"unknown error\0"),
        _ => return None,
    })
}

const CUDA_TIMEOUT_NAME: &[u8] = b"CUDA_ERROR_TIMEOUT\0";
