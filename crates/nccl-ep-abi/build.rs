//! Gives `libnccl_ep.so` NVIDIA's SONAME, `libnccl_ep.so.0`: programs linked against NVIDIA's
//! library record that name, and find this one under it (see the README).

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl_ep.so.0");
}
