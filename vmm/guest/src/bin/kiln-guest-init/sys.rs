//! Thin wrappers over the Linux system calls the init needs, each returning `io::Result`.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// A path as a C string. Errors: `InvalidInput` for a path with a NUL byte.
pub fn cpath(p: impl AsRef<OsStr>) -> io::Result<CString> {
    CString::new(p.as_ref().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// mount(2). `source` and `fstype` may be empty (passed as NULL), `data` too.
pub fn mount(
    source: &str,
    target: &Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> io::Result<()> {
    let src = cpath(source)?;
    let tgt = cpath(target)?;
    let fst = cpath(fstype)?;
    let dat = cpath(data)?;
    let opt = |c: &CString, s: &str| {
        if s.is_empty() {
            std::ptr::null()
        } else {
            c.as_ptr()
        }
    };
    // SAFETY: every pointer is NULL or a NUL-terminated string that outlives the call.
    check(unsafe {
        libc::mount(
            opt(&src, source),
            tgt.as_ptr(),
            opt(&fst, fstype),
            flags,
            opt(&dat, data).cast(),
        )
    })
}

/// chroot(2).
pub fn chroot(path: &Path) -> io::Result<()> {
    let p = cpath(path)?;
    // SAFETY: p is a NUL-terminated string that outlives the call.
    check(unsafe { libc::chroot(p.as_ptr()) })
}

/// mknod(2) of a character device.
pub fn mknod_char(path: &Path, mode: libc::mode_t, major: u32, minor: u32) -> io::Result<()> {
    let p = cpath(path)?;
    // SAFETY: p is a NUL-terminated string that outlives the call.
    check(unsafe {
        libc::mknod(
            p.as_ptr(),
            libc::S_IFCHR | mode,
            libc::makedev(major, minor),
        )
    })
}

/// finit_module(2) with no parameters. `EEXIST` (already loaded or built in) is success.
pub fn finit_module(fd: libc::c_int) -> io::Result<()> {
    let empty = c"";
    // SAFETY: fd is an open file descriptor; the parameter string is a static C string.
    let rc = unsafe { libc::syscall(libc::SYS_finit_module, fd, empty.as_ptr(), 0) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EEXIST) {
            return Ok(());
        }
        return Err(err);
    }
    Ok(())
}

/// sethostname(2).
pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes, valid for the call.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
}

/// clock_settime(CLOCK_REALTIME) to `ns` nanoseconds since the Unix epoch.
pub fn set_realtime(ns: u64) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: ts is a valid timespec for the duration of the call.
    check(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) })
}

/// getrandom(2) filling `buf` (blocking until the CRNG is ready).
pub fn getrandom(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        done += n as usize;
    }
    Ok(())
}

/// `RNDADDENTROPY` (linux/random.h: `_IOW('R', 0x03, int[2])`): mix `bytes` into the input
/// pool, crediting 8 bits per byte.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG` (linux/random.h: `_IO('R', 0x07)`): reseed the CRNG from the pool now.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// Add `bytes` to the kernel's entropy pool (credited) and reseed the CRNG, through
/// `fd` open on /dev/urandom or /dev/random. Needs CAP_SYS_ADMIN.
pub fn add_entropy_and_reseed(fd: libc::c_int, bytes: &[u8]) -> io::Result<()> {
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    let bits = (bytes.len() * 8) as i32;
    info.extend_from_slice(&bits.to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    // Keep the u32 array whole.
    info.resize(8 + bytes.len().div_ceil(4) * 4, 0);
    // SAFETY: info holds a rand_pool_info header followed by buf_size bytes, alive for the call.
    check(unsafe { libc::ioctl(fd, RNDADDENTROPY as _, info.as_ptr()) })?;
    // SAFETY: RNDRESEEDCRNG takes no argument.
    check(unsafe { libc::ioctl(fd, RNDRESEEDCRNG as _) })
}

/// reboot(2) to power off. Used when the init cannot go on (PID 1 must not exit).
pub fn power_off() {
    // SAFETY: sync and reboot take no pointers.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
}

/// Bring the loopback interface `lo` up (SIOCGIFFLAGS / SIOCSIFFLAGS with IFF_UP); the kernel
/// then gives it 127.0.0.1/8 and ::1 by itself.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: socket takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: fd is our socket; ifr is a valid ifreq for both calls; the union member read
    // is the one SIOCGIFFLAGS wrote.
    let res = unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr) < 0 {
            Err(io::Error::last_os_error())
        } else {
            ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            check(libc::ioctl(fd, libc::SIOCSIFFLAGS, &ifr))
        }
    };
    // SAFETY: closing the socket we opened.
    unsafe { libc::close(fd) };
    res
}
