//! Gives the stand-in the real driver's SONAME, so it can be installed as `libcuda.so.1`.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
