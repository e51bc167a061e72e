//! Logs as the kernel lays them out, read back; the crash states made from them hold
//! only what a power cut can leave.

use proptest::prelude::*;
use writelog::fuzzing::{Builder, sample_log};
use writelog::{Error, FLAG_FLUSH, FLAG_FUA, Log, Op};

fn read(bytes: &[u8]) -> Result<Log, Error> {
    Log::read(bytes, bytes.len() as u64, "test.log".as_ref())
}

/// The device after `state`, from a zeroed device of `len` bytes.
fn device_after(log: &Log, bytes: &[u8], state: &writelog::CrashState, len: usize) -> Vec<u8> {
    let mut dev = vec![0u8; len];
    log.apply(state, bytes, &mut dev, "dev".as_ref()).unwrap();
    dev
}

#[test]
fn the_sample_log_reads_as_written() {
    let bytes = sample_log();
    let log = read(&bytes).unwrap();
    assert_eq!(log.sector_size(), 512);
    let e = log.entries();
    assert_eq!(e.len(), 8);
    assert!(matches!(
        e[0].op,
        Op::Write {
            offset: 0,
            len: 1024,
            ..
        }
    ));
    assert!(matches!(
        e[1].op,
        Op::Write {
            offset: 4096,
            len: 512,
            ..
        }
    ));
    assert_eq!(e[2].op, Op::Flush);
    assert!(e[2].flush && !e[2].fua);
    assert!(e[3].fua && matches!(e[3].op, Op::Write { offset: 1024, .. }));
    assert_eq!(
        e[6].op,
        Op::Discard {
            offset: 8192,
            len: 2048
        }
    );
    assert_eq!(e[7].op, Op::Mark(writelog::END_MARK.into()));
    assert_eq!(log.mark(writelog::END_MARK), Some(7));
    assert_eq!(log.device_len(), 8192 + 2048);
    // After the flush, after the FUA write, and at the end.
    assert_eq!(log.durable_points(), vec![3, 4, 8]);
}

#[test]
fn clean_states_hold_every_acknowledged_write() {
    let bytes = sample_log();
    let log = read(&bytes).unwrap();
    let len = log.device_len() as usize;
    let at_flush = device_after(&log, &bytes, &log.clean_state(3), len);
    assert!(at_flush[..1024].iter().all(|&b| b == 1));
    assert!(at_flush[4096..4608].iter().all(|&b| b == 2));
    let end = device_after(&log, &bytes, &log.clean_state(8), len);
    assert!(end[..2048].iter().all(|&b| b == 4), "the later write wins");
    assert!(end[4608..5120].iter().all(|&b| b == 5));
    assert!(end[8192..].iter().all(|&b| b == 0));
}

#[test]
fn random_states_keep_what_was_durable() {
    let bytes = sample_log();
    let log = read(&bytes).unwrap();
    let len = log.device_len() as usize;
    let mut rng = fastrand::Rng::with_seed(1);
    let (mut lossy, mut torn) = (0, 0);
    for _ in 0..500 {
        let state = log.random_state_at(8, 512, &mut rng);
        assert_eq!(state.durable, 2, "the last flush is entry 2");
        let dev = device_after(&log, &bytes, &state, len);
        // The flushed write no later write covers, and the FUA write, always.
        assert!(dev[4096..4608].iter().all(|&b| b == 2));
        // Sector 2 holds the FUA write's 3s unless the later 4-sector write's
        // sector 2 reached the media.
        assert!(dev[1024..1536].iter().all(|&b| b == 3) || dev[1024..1536].iter().all(|&b| b == 4));
        lossy += usize::from(!state.is_clean());
        torn += usize::from(state.torn > 0);
    }
    assert!(lossy > 100 && torn > 50, "lossy {lossy}, torn {torn}");
}

#[test]
fn bad_logs_are_refused_with_their_offset() {
    let good = sample_log();
    let err = |bytes: &[u8]| read(bytes).unwrap_err().to_string();
    let mut b = good.clone();
    b[0] ^= 1;
    assert!(
        err(&b).contains("test.log: at offset 0: magic"),
        "{}",
        err(&b)
    );
    let mut b = good.clone();
    b[8] = 2;
    assert!(err(&b).contains("at offset 8: version 2"), "{}", err(&b));
    let mut b = good.clone();
    b[24..28].copy_from_slice(&1000u32.to_le_bytes());
    assert!(
        err(&b).contains("at offset 24: sector size 1000"),
        "{}",
        err(&b)
    );
    // The first write's data cut short.
    let mut b = good[..512 + 512 + 100].to_vec();
    b[16..24].copy_from_slice(&1u64.to_le_bytes());
    let e = err(&b);
    assert!(
        e.contains("at offset 1024: entry 0: its 1024 bytes of data pass the log's end"),
        "{e}"
    );
    let mut b = good.clone();
    b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(err(&b).contains("at offset 16:"), "{}", err(&b));
    // Unknown flags on entry 1 (its header is at 512 + 512 + 1024).
    let mut b = good.clone();
    b[2048 + 16] |= 0x80;
    assert!(
        err(&b).contains("at offset 2048: entry 1: unknown flags"),
        "{}",
        err(&b)
    );
    assert!(err(&[]).contains("too short"));
}

/// A random log: writes of 1-8 sectors over a 32-sector device, flushes, FUA writes
/// and discards, each write filled with its own index.
fn any_log() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec((0u8..10, 0u64..32, 1u64..9), 1..40).prop_map(|ops| {
        let mut b = Builder::new(512);
        for (i, (kind, sector, sectors)) in ops.into_iter().enumerate() {
            let sectors = sectors.min(32 - sector);
            let data = vec![(i + 1) as u8; sectors as usize * 512];
            b = match kind {
                0 => b.flush(),
                1 => b.write(sector, &data, FLAG_FUA),
                2 => b.write(sector, &data, FLAG_FLUSH),
                3 => b.discard(sector, sectors),
                _ => b.write(sector, &data, 0),
            };
        }
        b.build()
    })
}

proptest! {
    /// Every sector of a random state holds what the durable prefix left there or
    /// what one write after it put there; a sector no write after the prefix
    /// touched holds the durable prefix's bytes.
    #[test]
    fn random_states_hold_only_bytes_written_in_their_window(bytes in any_log(), seed: u64) {
        let log = read(&bytes).unwrap();
        let len = 32 * 512;
        let mut rng = fastrand::Rng::with_seed(seed);
        let unit = [512, 1024, 4096][(seed % 3) as usize];
        let state = log.random_state(unit, &mut rng);
        // A torn write reached the media in whole units (or up to its own edges).
        for p in &state.pieces {
            let (off, l) = log.entries()[p.entry].extent().unwrap();
            let (from, to) = (off + p.skip, off + p.skip + p.len);
            prop_assert!(from == off || from % unit == 0, "{:?} starts inside a unit of {}", p, unit);
            prop_assert!(to == off + l || to % unit == 0, "{:?} ends inside a unit of {}", p, unit);
        }
        let dev = device_after(&log, &bytes, &state, len);
        let base = device_after(&log, &bytes, &log.clean_state(state.durable), len);
        for s in 0..32 {
            let r = s * 512..(s + 1) * 512;
            let mut allowed = vec![base[r.clone()].to_vec()];
            for i in state.durable..state.acknowledged {
                let e = &log.entries()[i];
                if let Some((off, l)) = e.extent() && (off..off + l).contains(&(s as u64 * 512)) {
                    let fill = if matches!(e.op, Op::Discard { .. }) { 0 } else { (i + 1) as u8 };
                    allowed.push(vec![fill; 512]);
                }
            }
            prop_assert!(allowed.contains(&dev[r].to_vec()), "sector {} of {:?}", s, state);
        }
    }

    /// The clean state at the log's end is every entry applied in order.
    #[test]
    fn the_last_clean_state_is_the_whole_log(bytes in any_log()) {
        let log = read(&bytes).unwrap();
        let len = 32 * 512;
        let dev = device_after(&log, &bytes, &log.clean_state(log.entries().len()), len);
        let mut model = vec![0u8; len];
        for (i, e) in log.entries().iter().enumerate() {
            if let Some((off, l)) = e.extent() {
                let fill = if matches!(e.op, Op::Discard { .. }) { 0 } else { (i + 1) as u8 };
                model[off as usize..(off + l) as usize].fill(fill);
            }
        }
        prop_assert_eq!(dev, model);
    }
}
