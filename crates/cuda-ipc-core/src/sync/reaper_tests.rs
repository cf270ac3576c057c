//! The reaper's tests: the library's reaper with steps that wait for no
//! GPU work, and reapers over a stand-in driver whose calls fail on purpose.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

#[test]
fn a_step_with_nothing_to_wait_for_runs_on_the_reaper_and_settle_sees_it() {
    let ran = Arc::new(AtomicUsize::new(0));
    let caller = std::thread::current().id();
    let on = Arc::new(Mutex::new(None));
    for _ in 0..100 {
        let (ran, on) = (ran.clone(), on.clone());
        soon("test step", move || {
            ran.fetch_add(1, Ordering::SeqCst);
            *on.lock().unwrap() = Some(std::thread::current().id());
        });
    }
    assert!(
        settle(Duration::from_secs(5)),
        "{} still retiring",
        retiring()
    );
    assert_eq!(ran.load(Ordering::SeqCst), 100);
    assert_ne!(
        on.lock().unwrap().unwrap(),
        caller,
        "ran on the caller's thread"
    );
}

#[test]
fn a_step_may_retire_another() {
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    soon("outer", move || {
        let r2 = r.clone();
        soon("inner", move || {
            std::thread::sleep(Duration::from_millis(20));
            r2.fetch_add(1, Ordering::SeqCst);
        });
        r.fetch_add(1, Ordering::SeqCst);
    });
    assert!(settle(Duration::from_secs(5)));
    assert_eq!(
        ran.load(Ordering::SeqCst),
        2,
        "settle waits for what steps retire"
    );
}

#[test]
fn a_panicking_step_does_not_stop_the_reaper() {
    soon("panics", || panic!("on purpose"));
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    soon("after", move || {
        r.fetch_add(1, Ordering::SeqCst);
    });
    assert!(settle(Duration::from_secs(5)));
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

#[test]
fn settle_gives_up_at_its_deadline() {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    soon("blocked", move || {
        let _ = rx.recv_timeout(Duration::from_secs(5));
    });
    let started = Instant::now();
    assert!(!settle(Duration::from_millis(50)));
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(retiring() >= 1);
    tx.send(()).unwrap();
    assert!(settle(Duration::from_secs(5)));
}

mod failing_driver {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use cudarc::driver::sys::CUresult;

    use super::super::{Driver, Reaper};
    use super::*;

    /// A stand-in driver: "the GPU's work" is done once `work_done` is
    /// set; every call can be made to fail. Contexts and events are
    /// numbers; a stream is `(context, stream)`.
    #[derive(Default)]
    struct Standin {
        work_done: AtomicBool,
        fail_new_event: AtomicBool,
        fail_record: AtomicBool,
        fail_bind: AtomicBool,
        fail_query: AtomicBool,
        fail_sync: AtomicBool,
        syncs: AtomicUsize,
    }

    fn check(fail: &AtomicBool, call: &'static str) -> Result<(), Error> {
        if fail.load(Ordering::SeqCst) {
            return Err(crate::error::driver_error(
                call,
                CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            ));
        }
        Ok(())
    }

    impl Standin {
        fn wait_for_work(&self) {
            while !self.work_done.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    impl Driver for &'static Standin {
        type Context = usize;
        type Stream = (usize, usize);
        type Event = usize;

        fn context_of(&self, stream: &(usize, usize)) -> usize {
            stream.0
        }
        fn context_id(&self, ctx: &usize) -> usize {
            *ctx
        }
        fn stream_id(&self, stream: &(usize, usize)) -> usize {
            stream.1
        }
        fn event_context_id(&self, event: &usize) -> usize {
            *event
        }
        fn new_event(&self, ctx: &usize) -> Result<usize, Error> {
            check(&self.fail_new_event, "cuEventCreate").map(|()| *ctx)
        }
        fn record(&self, _: &usize, _: &(usize, usize)) -> Result<(), Error> {
            check(&self.fail_record, "cuEventRecord")
        }
        fn bind(&self, _: &usize) -> Result<(), Error> {
            check(&self.fail_bind, "cuCtxSetCurrent")
        }
        fn query(&self, _: &usize) -> Result<bool, Error> {
            check(&self.fail_query, "cuEventQuery")?;
            Ok(self.work_done.load(Ordering::SeqCst))
        }
        fn wait(&self, _: &usize) -> Result<(), Error> {
            self.wait_for_work();
            Ok(())
        }
        fn synchronize(&self, _: &usize) -> Result<(), Error> {
            self.syncs.fetch_add(1, Ordering::SeqCst);
            check(&self.fail_sync, "cuCtxSynchronize")?;
            self.wait_for_work();
            Ok(())
        }
    }

    /// A stand-in with `fail` set, and a reaper of its own over it.
    fn reaper_failing(
        fail: impl FnOnce(&Standin) -> &AtomicBool,
    ) -> (&'static Standin, &'static Reaper<&'static Standin>) {
        let d: &'static Standin = Box::leak(Box::default());
        fail(d).store(true, Ordering::SeqCst);
        (d, Box::leak(Box::new(Reaper::new(d))))
    }

    /// A step retired on two streams of context 1 whose flag says it ran.
    fn retire(r: &'static Reaper<&'static Standin>) -> Arc<AtomicBool> {
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        r.after_streams(
            [&(1, 10), &(1, 11)],
            "a stand-in step",
            Box::new(move || flag.store(true, Ordering::SeqCst)),
        );
        ran
    }

    /// The step did not run while its work was not done, and runs after a
    /// barrier over its context once the work is.
    fn runs_only_after_the_work(d: &Standin, r: &Reaper<&'static Standin>, ran: &AtomicBool) {
        assert!(
            !r.settle(Duration::from_millis(100)),
            "settled while the work was running"
        );
        assert!(
            !ran.load(Ordering::SeqCst),
            "released while the GPU work may still run"
        );
        d.work_done.store(true, Ordering::SeqCst);
        assert!(r.settle(Duration::from_secs(5)), "{} left", r.retiring());
        assert!(ran.load(Ordering::SeqCst));
        assert!(
            d.syncs.load(Ordering::SeqCst) >= 1,
            "no barrier over the context"
        );
    }

    #[test]
    fn an_event_that_cannot_be_made_waits_for_the_whole_context() {
        let (d, r) = reaper_failing(|d| &d.fail_new_event);
        let ran = retire(r);
        runs_only_after_the_work(d, r, &ran);
    }

    #[test]
    fn an_event_that_cannot_be_recorded_waits_for_the_whole_context() {
        let (d, r) = reaper_failing(|d| &d.fail_record);
        let ran = retire(r);
        runs_only_after_the_work(d, r, &ran);
    }

    #[test]
    fn an_event_that_cannot_be_queried_waits_for_the_whole_context() {
        let (d, r) = reaper_failing(|d| &d.fail_query);
        let ran = retire(r);
        runs_only_after_the_work(d, r, &ran);
    }

    #[test]
    fn a_context_that_cannot_be_made_current_is_waited_for_whole() {
        let (d, r) = reaper_failing(|d| &d.fail_bind);
        let ran = retire(r);
        runs_only_after_the_work(d, r, &ran);
    }

    #[test]
    fn a_step_whose_barrier_fails_is_kept_and_never_run() {
        let (d, r) = reaper_failing(|d| &d.fail_sync);
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        r.after_contexts(
            vec![1],
            "a stand-in step",
            Box::new(move || flag.store(true, Ordering::SeqCst)),
        );
        let started = Instant::now();
        assert!(
            !r.settle(Duration::from_secs(5)),
            "settled with a step whose work was never seen to finish"
        );
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "settle waited for a step that is kept for ever"
        );
        assert_eq!(r.retiring(), 1, "the kept step is still counted");
        d.work_done.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!ran.load(Ordering::SeqCst), "ran after a failed barrier");
        assert!(d.syncs.load(Ordering::SeqCst) >= 1);
    }

    #[test]
    fn steps_whose_events_complete_run_without_a_barrier() {
        let (d, r) = reaper_failing(|d| &d.fail_sync);
        let ran = retire(r);
        assert!(!r.settle(Duration::from_millis(50)));
        assert!(!ran.load(Ordering::SeqCst));
        d.work_done.store(true, Ordering::SeqCst);
        assert!(r.settle(Duration::from_secs(5)));
        assert!(ran.load(Ordering::SeqCst));
        assert_eq!(d.syncs.load(Ordering::SeqCst), 0, "a barrier was asked for");
    }
}
