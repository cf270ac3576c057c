use super::*;
pub(crate) use sys::CUdevice_attribute as Attr;

/// `cuDeviceGetCount`.
pub(crate) fn count() -> Result<usize> {
    let mut n = 0;
    // SAFETY: valid out-pointer.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&raw mut n)
    })?;
    Ok(n.max(0) as usize)
}

/// `cuDeviceGet`.
pub(crate) fn get(ordinal: usize) -> Result<sys::CUdevice> {
    let mut d = 0;
    // SAFETY: valid out-pointer; the driver checks the ordinal.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&raw mut d, ordinal as i32)
    })?;
    Ok(d)
}

/// `cuDeviceGetAttribute`.
pub(crate) fn attribute(dev: sys::CUdevice, attr: Attr) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer; `dev` came from cuDeviceGet.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&raw mut v, attr, dev)
    })?;
    Ok(v)
}

/// `cuDeviceGetName`.
pub(crate) fn name(dev: sys::CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer's length is passed; the driver NUL-terminates.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev)
    })?;
    Ok(c_chars_to_string(&buf))
}

/// `cuDeviceGetUuid_v2`.
pub(crate) fn uuid(dev: sys::CUdevice) -> Result<[u8; 16]> {
    let mut u = MaybeUninit::<sys::CUuuid>::uninit();
    // SAFETY: valid out-pointer, initialised by the call on success.
    check("cuDeviceGetUuid", unsafe {
        sys::cuDeviceGetUuid_v2(u.as_mut_ptr(), dev)
    })?;
    // SAFETY: the call succeeded, so `u` is initialised.
    let u = unsafe { u.assume_init() };
    Ok(u.bytes.map(|c| c as u8))
}

/// `cuDeviceGetPCIBusId`.
pub(crate) fn pci_bus_id(dev: sys::CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 64];
    // SAFETY: the buffer's length is passed; the driver NUL-terminates.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev)
    })?;
    Ok(c_chars_to_string(&buf))
}

/// `cuDeviceTotalMem_v2`.
pub(crate) fn total_mem(dev: sys::CUdevice) -> Result<u64> {
    let mut n = 0usize;
    // SAFETY: valid out-pointer.
    check("cuDeviceTotalMem", unsafe {
        sys::cuDeviceTotalMem_v2(&raw mut n, dev)
    })?;
    Ok(n as u64)
}

/// `cuDeviceCanAccessPeer`.
pub(crate) fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
    let mut v = 0;
    // SAFETY: valid out-pointer.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&raw mut v, dev, peer)
    })?;
    Ok(v != 0)
}

/// `cuDeviceGetP2PAttribute`.
pub(crate) fn p2p_attribute(
    attr: sys::CUdevice_P2PAttribute,
    src: sys::CUdevice,
    dst: sys::CUdevice,
) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer.
    check("cuDeviceGetP2PAttribute", unsafe {
        sys::cuDeviceGetP2PAttribute(&raw mut v, attr, src, dst)
    })?;
    Ok(v)
}

fn c_chars_to_string(buf: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
