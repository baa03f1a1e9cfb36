//! A thread pool pinned to one NUMA node's cores, for the expert kernels.
//!
//! Owns: worker threads (pinned with `sched_setaffinity` on Linux), job dispatch, a spin
//! barrier the job's phases synchronise on, and `/sys/devices/system/node/nodeN/cpulist`
//! parsing. The hot path (`ThreadPool::run`, `WorkerContext::barrier`) allocates nothing and
//! takes no lock: dispatch is an epoch counter, completion a counter, both atomics. Idle workers
//! spin for a short while (decode calls come back-to-back), then park.
//! Must not touch: what the jobs compute.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use crate::KernelError;

/// Spin iterations before a waiting thread starts yielding / an idle worker parks. About
/// 50–100 µs of spinning: long enough to bridge the gap between two layers of one decode step.
const SPINS_BEFORE_YIELD: u32 = 1 << 14;
const SPINS_BEFORE_PARK: u32 = 1 << 16;

type Job = dyn Fn(&WorkerContext<'_>) + Sync;

/// What a job sees on each thread.
pub struct WorkerContext<'a> {
    /// 0 for the calling thread, 1.. for workers.
    pub index: usize,
    /// Threads running the job.
    pub count: usize,
    barrier: &'a SpinBarrier,
}

impl WorkerContext<'_> {
    /// Waits until every thread of the job has reached this point.
    pub fn barrier(&self) {
        self.barrier.wait();
    }

    /// This thread's contiguous share of `0..total` (shares differ by at most one).
    pub fn split(&self, total: usize) -> Range<usize> {
        split_range(total, self.index, self.count)
    }
}

/// Contiguous share `index` of `count` of `0..total`.
pub fn split_range(total: usize, index: usize, count: usize) -> Range<usize> {
    let start = total * index / count;
    let end = total * (index + 1) / count;
    start..end
}

/// Sense-free generation barrier for a fixed number of threads.
pub struct SpinBarrier {
    threads: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    poisoned: AtomicBool,
}

impl SpinBarrier {
    fn new(threads: usize) -> Self {
        SpinBarrier {
            threads,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
        }
    }

    pub fn wait(&self) {
        if self.threads == 1 {
            return;
        }
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            // A thread that panicked never arrives; don't wait for it forever.
            if self.poisoned.load(Ordering::Relaxed) {
                return;
            }
            spin_or_yield(&mut spins);
        }
    }
}

#[inline]
fn spin_or_yield(spins: &mut u32) {
    if *spins < SPINS_BEFORE_YIELD {
        *spins += 1;
        std::hint::spin_loop();
    } else {
        // On an oversubscribed machine (CI, 2 cores) pure spinning would starve the threads we
        // wait for.
        std::thread::yield_now();
    }
}

struct PoolShared {
    /// Incremented (Release) after `job` is written; workers run the job of each new epoch.
    epoch: AtomicU64,
    job: UnsafeCell<Option<*const Job>>,
    finished: AtomicUsize,
    shutdown: AtomicBool,
    panicked: AtomicBool,
    barrier: SpinBarrier,
    parked: Vec<AtomicBool>,
}

// SAFETY: `job` is written only by the dispatching thread while no worker reads it (between the
// previous job's completion and the epoch increment that publishes the new one); workers read it
// only after observing the new epoch with Acquire ordering.
unsafe impl Sync for PoolShared {}
unsafe impl Send for PoolShared {}

/// Worker threads plus the calling thread, which takes part in every job as index 0.
pub struct ThreadPool {
    shared: Arc<PoolShared>,
    workers: Vec<JoinHandle<()>>,
    handles: Vec<Thread>,
    cpus: Vec<usize>,
    /// The caller's affinity before `pin_caller` pinned it, restored on drop: a thread pinned
    /// for one pool (a bandwidth measurement, say) must not stay pinned — every thread and
    /// child process it starts later would inherit that one CPU.
    caller_affinity: Option<CallerAffinity>,
    /// Serialises `run` callers (a pool runs one job at a time); taken once per job, outside
    /// the threads' hot loops.
    dispatch: std::sync::Mutex<()>,
}

impl ThreadPool {
    /// A pool of `threads` threads (the caller counts as one). With `cpus` non-empty, thread `i`
    /// is pinned to `cpus[i % cpus.len()]`, the caller too when `pin_caller`.
    pub fn new(threads: usize, cpus: &[usize], pin_caller: bool) -> Result<Self, KernelError> {
        let threads = threads.max(1);
        let shared = Arc::new(PoolShared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            finished: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            barrier: SpinBarrier::new(threads),
            parked: (0..threads).map(|_| AtomicBool::new(false)).collect(),
        });
        let caller_affinity = if pin_caller && !cpus.is_empty() {
            let saved = CallerAffinity::of_current_thread();
            pin_current_thread(cpus[0])?;
            saved
        } else {
            None
        };
        let mut workers = Vec::with_capacity(threads - 1);
        let mut handles = Vec::with_capacity(threads - 1);
        for index in 1..threads {
            let shared = Arc::clone(&shared);
            let cpu = (!cpus.is_empty()).then(|| cpus[index % cpus.len()]);
            let handle = std::thread::Builder::new()
                .name(format!("ninfer-expert-{index}"))
                .spawn(move || {
                    if let Some(cpu) = cpu {
                        // Pinning is a performance hint: an unpinned worker still computes.
                        let _ = pin_current_thread(cpu);
                    }
                    worker_loop(&shared, index, threads);
                })
                .map_err(|error| KernelError::Pool(format!("cannot spawn worker: {error}")))?;
            handles.push(handle.thread().clone());
            workers.push(handle);
        }
        Ok(ThreadPool {
            shared,
            workers,
            handles,
            cpus: cpus.to_vec(),
            caller_affinity,
            dispatch: std::sync::Mutex::new(()),
        })
    }

    /// A pool on the cores of NUMA node `node` (all CPUs this process may use when the machine
    /// reports no such node); `threads` defaults to one per physical core, each pinned to its
    /// own core first ([`cpus_by_physical_core`]).
    pub fn for_numa_node(node: usize, threads: Option<usize>) -> Result<Self, KernelError> {
        let cpus = cpus_of_numa_node(node).unwrap_or_else(|_| allowed_cpus());
        let (cpus, cores) = cpus_by_physical_core(&cpus);
        let threads = threads.unwrap_or(cores).max(1);
        ThreadPool::new(threads, &cpus, true)
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// Runs `job` on every thread (the caller as index 0) and returns when all have finished.
    pub fn run(&self, job: &(dyn Fn(&WorkerContext<'_>) + Sync)) -> Result<(), KernelError> {
        let _serial = self
            .dispatch
            .lock()
            .map_err(|_| KernelError::Pool("pool dispatch lock poisoned".into()))?;
        if self.shared.panicked.load(Ordering::Relaxed) {
            return Err(KernelError::Pool(
                "a worker panicked in an earlier job".into(),
            ));
        }
        let shared = &*self.shared;
        let threads = self.threads();
        // SAFETY: the lifetime is erased only for the duration of this call: we do not return
        // before every worker has incremented `finished`, after which none touches the job.
        let job_pointer: *const (dyn Fn(&WorkerContext<'_>) + Sync + '_) = job;
        let job_static: *const Job = unsafe { std::mem::transmute(job_pointer) };
        // SAFETY: no worker reads `job` now: all finished the previous epoch (we waited for
        // that) and none starts before the epoch increment below.
        unsafe { *shared.job.get() = Some(job_static) };
        shared.finished.store(0, Ordering::Relaxed);
        shared.epoch.fetch_add(1, Ordering::SeqCst);
        for (index, handle) in self.handles.iter().enumerate() {
            if shared.parked[index + 1].load(Ordering::SeqCst) {
                handle.unpark();
            }
        }
        let context = WorkerContext {
            index: 0,
            count: threads,
            barrier: &shared.barrier,
        };
        let caller_result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&context)));
        if caller_result.is_err() {
            shared.panicked.store(true, Ordering::Relaxed);
            shared.barrier.poisoned.store(true, Ordering::Relaxed);
        }
        let mut spins = 0u32;
        while shared.finished.load(Ordering::Acquire) != threads - 1 {
            spin_or_yield(&mut spins);
        }
        if shared.panicked.load(Ordering::Relaxed) {
            return Err(KernelError::Pool(
                "a thread panicked while running a job".into(),
            ));
        }
        Ok(())
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for handle in &self.handles {
            handle.unpark();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
        if let Some(saved) = self.caller_affinity.take() {
            saved.restore();
        }
    }
}

/// A thread's CPU affinity mask, to put back later (from any thread: by thread id).
struct CallerAffinity {
    #[cfg(target_os = "linux")]
    thread: libc::pid_t,
    #[cfg(target_os = "linux")]
    mask: libc::cpu_set_t,
}

impl CallerAffinity {
    fn of_current_thread() -> Option<Self> {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size;
            // gettid has no preconditions.
            unsafe {
                let mut mask: libc::cpu_set_t = std::mem::zeroed();
                if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut mask)
                    != 0
                {
                    return None;
                }
                Some(CallerAffinity {
                    thread: libc::gettid(),
                    mask,
                })
            }
        }
        #[cfg(not(target_os = "linux"))]
        None
    }

    fn restore(&self) {
        #[cfg(target_os = "linux")]
        // SAFETY: the mask came from sched_getaffinity; a thread that has exited makes the call
        // fail harmlessly (ESRCH).
        unsafe {
            let _ = libc::sched_setaffinity(
                self.thread,
                std::mem::size_of::<libc::cpu_set_t>(),
                &self.mask,
            );
        }
    }
}

fn worker_loop(shared: &PoolShared, index: usize, threads: usize) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        let epoch = loop {
            let epoch = shared.epoch.load(Ordering::Acquire);
            if epoch != seen {
                break epoch;
            }
            if spins < SPINS_BEFORE_PARK {
                spins += 1;
                std::hint::spin_loop();
            } else {
                shared.parked[index].store(true, Ordering::SeqCst);
                // Re-check after announcing: a dispatcher that bumped the epoch before seeing
                // the flag did not unpark us.
                if shared.epoch.load(Ordering::SeqCst) == seen {
                    std::thread::park_timeout(Duration::from_millis(50));
                }
                shared.parked[index].store(false, Ordering::SeqCst);
            }
        };
        seen = epoch;
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: the epoch was published after `job` was written (Release/Acquire), and the
        // dispatcher keeps the job alive until we increment `finished`.
        let job = unsafe { (*shared.job.get()).map(|job| &*job) };
        if let Some(job) = job {
            let context = WorkerContext {
                index,
                count: threads,
                barrier: &shared.barrier,
            };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&context))).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
                shared.barrier.poisoned.store(true, Ordering::Relaxed);
            }
        }
        shared.finished.fetch_add(1, Ordering::Release);
    }
}

/// Parses a Linux cpulist such as `0-7,16-23,32`.
pub fn parse_cpulist(text: &str) -> Result<Vec<usize>, KernelError> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let bad = || KernelError::Pool(format!("malformed cpulist entry `{part}` in `{text}`"));
        match part.split_once('-') {
            Some((first, last)) => {
                let first: usize = first.trim().parse().map_err(|_| bad())?;
                let last: usize = last.trim().parse().map_err(|_| bad())?;
                if last < first {
                    return Err(bad());
                }
                cpus.extend(first..=last);
            }
            None => cpus.push(part.trim().parse().map_err(|_| bad())?),
        }
    }
    Ok(cpus)
}

/// The CPUs of NUMA node `node` that this process may run on.
pub fn cpus_of_numa_node(node: usize) -> Result<Vec<usize>, KernelError> {
    let path = format!("/sys/devices/system/node/node{node}/cpulist");
    let text = std::fs::read_to_string(&path)
        .map_err(|error| KernelError::Pool(format!("cannot read {path}: {error}")))?;
    let allowed = allowed_cpus();
    let cpus: Vec<usize> = parse_cpulist(&text)?
        .into_iter()
        .filter(|cpu| allowed.contains(cpu))
        .collect();
    if cpus.is_empty() {
        return Err(KernelError::Pool(format!(
            "NUMA node {node} has no CPU this process may use"
        )));
    }
    Ok(cpus)
}

/// `cpus` ordered one thread of every physical core first (each core's lowest-numbered CPU of
/// `cpus`, in `cpus`' order), then the other hardware threads, and how many come first: a pool
/// of that many threads pinned in this order puts one worker on each core. The expert kernels
/// are bound by memory bandwidth and each core's vector or matrix units, which two hardware
/// threads of a core share, so the second thread adds little and takes the CPU time the engine
/// and the operating system need (a worker interrupted mid-layer stalls every other worker at
/// the layer's barrier). Cores are read from sysfs (`topology/thread_siblings_list`); a CPU
/// without that file counts as a core of its own.
pub fn cpus_by_physical_core(cpus: &[usize]) -> (Vec<usize>, usize) {
    order_by_core(cpus, |cpu| {
        let path = format!("/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list");
        std::fs::read_to_string(path)
            .ok()
            .and_then(|text| parse_cpulist(&text).ok())
    })
}

/// [`cpus_by_physical_core`] with the siblings of each CPU (itself included) from `siblings`.
fn order_by_core(
    cpus: &[usize],
    siblings: impl Fn(usize) -> Option<Vec<usize>>,
) -> (Vec<usize>, usize) {
    let (mut first, mut rest) = (Vec::new(), Vec::new());
    for &cpu in cpus {
        let core_first = siblings(cpu)
            .and_then(|list| list.into_iter().filter(|other| cpus.contains(other)).min())
            .unwrap_or(cpu);
        if core_first == cpu {
            first.push(cpu);
        } else {
            rest.push(cpu);
        }
    }
    let cores = first.len();
    first.extend(rest);
    (first, cores)
}

/// The CPUs this process may run on (its affinity mask), or `0..available_parallelism`.
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                    .filter(|&cpu| libc::CPU_ISSET(cpu, &set))
                    .collect();
                if !cpus.is_empty() {
                    return cpus;
                }
            }
        }
    }
    let count = std::thread::available_parallelism().map_or(1, |n| n.get());
    (0..count).collect()
}

/// Pins the calling thread to one CPU (no-op outside Linux).
pub fn pin_current_thread(cpu: usize) -> Result<(), KernelError> {
    #[cfg(target_os = "linux")]
    {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(KernelError::Pool(format!("cpu {cpu} out of range")));
        }
        // SAFETY: cpu_set_t is plain data and `cpu` is inside it; sched_setaffinity reads it.
        let result = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        if result != 0 {
            return Err(KernelError::Pool(format!(
                "cannot pin thread to cpu {cpu}: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cpu;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pinned_caller_gets_its_affinity_back_when_the_pool_goes() {
        let before = allowed_cpus();
        let pool = ThreadPool::new(2, &[before[0]], true).unwrap();
        assert_eq!(allowed_cpus(), vec![before[0]]);
        drop(pool);
        assert_eq!(allowed_cpus(), before);
    }

    #[test]
    fn one_thread_of_each_core_comes_first() {
        // Two-way SMT numbered as Linux does on most x86 machines: CPU c and c + 4 share a core.
        let smt = |cpu: usize| Some(vec![cpu % 4, cpu % 4 + 4]);
        let all: Vec<usize> = (0..8).collect();
        assert_eq!(order_by_core(&all, smt), (vec![0, 1, 2, 3, 4, 5, 6, 7], 4));
        // Siblings numbered next to each other (0-1, 2-3, ...).
        let pairs = |cpu: usize| Some(vec![cpu / 2 * 2, cpu / 2 * 2 + 1]);
        assert_eq!(
            order_by_core(&all, pairs),
            (vec![0, 2, 4, 6, 1, 3, 5, 7], 4)
        );
        // A sibling outside the allowed set does not hide its core; no topology: every CPU a core.
        assert_eq!(order_by_core(&[1, 5, 6], smt), (vec![1, 6, 5], 2));
        assert_eq!(order_by_core(&[4, 5], smt), (vec![4, 5], 2));
        assert_eq!(order_by_core(&[3, 7, 9], |_| None), (vec![3, 7, 9], 3));
    }

    #[test]
    fn parses_cpulists() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n").unwrap(),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert!(parse_cpulist("3-1").is_err());
        assert!(parse_cpulist("a").is_err());
    }

    #[test]
    fn runs_jobs_with_barriers_on_every_thread() {
        let pool = ThreadPool::new(3, &[], false).unwrap();
        let counter = AtomicUsize::new(0);
        for round in 0..50 {
            pool.run(&|context: &WorkerContext<'_>| {
                counter.fetch_add(1, Ordering::Relaxed);
                context.barrier();
                // After the barrier every thread sees every increment of this round.
                assert!(counter.load(Ordering::Relaxed) >= 3 * (round + 1));
                context.barrier();
            })
            .unwrap();
        }
        assert_eq!(counter.load(Ordering::Relaxed), 150);
    }

    #[test]
    fn split_covers_everything_once() {
        let mut covered = [0; 37];
        for index in 0..5 {
            for i in split_range(37, index, 5) {
                covered[i] += 1;
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
    }
}
