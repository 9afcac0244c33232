//! Any bytes as what the guest init reads from its port (`kiln_guest::protocol`, the guest
//! side): cut into reads, pushed through `FrameBuffer::push_watching_connect` and
//! `next_frame`, each body through `decode_body`, as the init's serve loop does; and the
//! same bytes through the blocking `read_frame`. Errors are fine, panics are not. A decoded
//! message must encode and decode to itself, and the `error` answer to a refused frame must
//! encode.
#![no_main]

use kiln_guest::protocol::{
    ErrorMessage, FrameBuffer, MAX_FRAME_LEN, Message, decode_body, encode, encode_body, read_frame,
};
use libfuzzer_sys::fuzz_target;

fn body(body: &[u8]) {
    match decode_body(body) {
        Ok(msg) => {
            let again = encode_body(&msg).expect("a decoded message encodes");
            assert_eq!(decode_body(&again).expect("decodes again"), msg);
            if let Message::Restore(r) = &msg {
                let _ = r.entropy_bytes();
            }
        }
        Err(e) => {
            encode(&Message::error(&e)).expect("the error answer encodes");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // The first byte sets the read size (1 to 256 bytes), as a port read may return any.
    let Some((&cut, stream)) = data.split_first() else {
        return;
    };
    let cut = usize::from(cut) + 1;
    let mut frames = FrameBuffer::new();
    for read in stream.chunks(cut) {
        frames.push_watching_connect(read);
        loop {
            match frames.next_frame() {
                Ok(Some(b)) => {
                    assert!(!b.is_empty() && b.len() <= MAX_FRAME_LEN);
                    body(&b);
                }
                Ok(None) => break,
                Err(e) => {
                    let answer = Message::Error(ErrorMessage {
                        message: e.to_string(),
                    });
                    encode(&answer).expect("the error answer encodes");
                    frames = FrameBuffer::new();
                    break;
                }
            }
        }
    }
    let _ = frames.finish();

    let mut r = stream;
    while let Ok(Some(b)) = read_frame(&mut r) {
        body(&b);
    }
});
