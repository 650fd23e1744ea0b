//! Arbitrary bytes into the frame parser: it must never panic, and whatever it accepts must
//! verify, display and re-emit consistently.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xroce_core::icrc;
use xroce_core::wire::{emit_frame, RoceFrame};

fuzz_target!(|data: &[u8]| {
    let _ = icrc::verify(data);
    for parsed in [RoceFrame::parse_ethernet(data), RoceFrame::parse_ip(data)] {
        let Ok(f) = parsed else { continue };
        let _ = f.verify();
        let _ = f.to_string();
        // Re-emitting what was parsed must give a frame that parses to the same headers.
        let mut buf = vec![0u8; data.len() + 64];
        let n = emit_frame(&mut buf, &f.headers, f.payload).expect("parsed headers re-emit");
        let again = if f.headers.eth.is_some() {
            RoceFrame::parse_ethernet(&buf[..n])
        } else {
            RoceFrame::parse_ip(&buf[..n])
        }
        .expect("re-emitted frame parses");
        assert_eq!(again.payload, f.payload);
        assert!(again.verify().is_ok(), "re-emitted frame must verify");
    }
});
