"""Is the machine quiet enough to measure on? What a bench records about the machine around its run.

    machine       CPU model, cores the bench may use, frequency governor and current frequency (where readable)
    load          the load average before and after the run
    steal         CPU time the hypervisor took from this VM during the run (/proc/stat)
    other CPU     the machine's busy CPU time minus what the bench's own processes used, in cores, over windows
                  of consecutive requests at least WINDOW_S long (the kernel counts CPU time in 10 ms ticks, so
                  a shorter request cannot be judged alone); a window in which another process used more than
                  NOISY_CORES is counted noisy
    idle engines  CPU time the engines that were not running used during other engines' requests (their
                  threads must sleep, not spin, for the running engine to have the cores)

Linux only for the /proc and /sys figures; elsewhere they are reported as unknown (None).
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

NOISY_CORES = 0.25  # another process using a quarter of a core during a window makes that window noisy
WINDOW_S = 0.5  # requests are judged in windows at least this long
STEAL_FRACTION = 0.02  # steal above 2% of the run's CPU time is reported as noise too


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_info() -> dict:
    """CPU model, usable cores, frequency governor and MHz (None where not readable)."""
    cpuinfo = (_read("/proc/cpuinfo") or "").splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    freq = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
    if freq is None:  # VMs often expose no cpufreq: /proc/cpuinfo's current MHz
        mhz = next((line.split(":", 1)[1] for line in cpuinfo if line.startswith("cpu MHz")), None)
        freq_mhz = round(float(mhz), 1) if mhz else None
    else:
        freq_mhz = round(int(freq) / 1000, 1)
    return {"cpu": model or platform.processor() or platform.machine(), "cores": cores(),
            "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"), "cpu_mhz": freq_mhz,
            "platform": platform.platform()}


@dataclass(frozen=True)
class CpuSample:
    busy_s: float | None  # the whole machine's busy CPU seconds since boot (None: not readable)
    steal_s: float | None

    @classmethod
    def now(cls) -> "CpuSample":
        line = (_read("/proc/stat") or "").splitlines()[:1]
        if not line or not line[0].startswith("cpu "):
            return cls(None, None)
        v = [int(x) for x in line[0].split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
        return cls((user + nice + system + irq + softirq) / tick, steal / tick)


class QuietCheck:
    """Accumulates, request by request, how much CPU went to anything but the running engine."""

    def __init__(self) -> None:
        self.load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
        self.start = CpuSample.now()
        self.requests = self.windows = self.noisy = 0
        self.other_s = self.wall_s = self.idle_engines_s = 0.0
        self.idle_by_engine: dict[str, float] = {}
        self.worst = 0.0
        self._window = [0.0, 0.0]  # wall and other CPU seconds of the requests not judged yet

    def add(self, wall_s: float, busy_s: float | None, bench_s: float, idle_engines_s: float,
            idle_by_engine: dict[str, float] | None = None) -> None:
        """One request: its wall time, the machine's busy CPU seconds during it, what the bench's own processes
        used (the parent and every engine) and what the engines not running used (in all, and by engine)."""
        self.requests += 1
        self.idle_engines_s += idle_engines_s
        for name, s in (idle_by_engine or {}).items():
            self.idle_by_engine[name] = self.idle_by_engine.get(name, 0.0) + s
        if busy_s is None or wall_s <= 0:
            return
        self.wall_s += wall_s
        other = max(0.0, busy_s - bench_s)
        self.other_s += other
        self._window[0] += wall_s
        self._window[1] += other
        if self._window[0] >= WINDOW_S:
            self._judge()

    def _judge(self) -> None:
        wall, other = self._window
        self._window = [0.0, 0.0]
        if wall <= 0:
            return
        cores = other / wall
        self.windows += 1
        self.worst = max(self.worst, cores)
        self.noisy += cores > NOISY_CORES

    def report(self) -> dict:
        if self._window[0] >= WINDOW_S / 4 or not self.windows:  # the tail, unless too short to judge
            self._judge()
        end = CpuSample.now()
        steal = (end.steal_s - self.start.steal_s) if end.steal_s is not None and self.start.steal_s is not None \
            else None
        steal_fraction = steal / (self.wall_s * cores()) if steal is not None and self.wall_s else None
        quiet = self.noisy == 0 and (steal_fraction is None or steal_fraction <= STEAL_FRACTION)
        out = {"quiet": quiet, "load_before": self.load_before,
               "load_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
               "steal_s": round(steal, 2) if steal is not None else None,
               "steal_fraction": round(steal_fraction, 4) if steal_fraction is not None else None,
               "requests": self.requests, "windows": self.windows, "noisy_windows": self.noisy,
               "other_cores_mean": round(self.other_s / self.wall_s, 3) if self.wall_s else None,
               "other_cores_max": round(self.worst, 3), "idle_engines_cpu_s": round(self.idle_engines_s, 3),
               "idle_cpu_s_by_engine": {k: round(v, 3) for k, v in self.idle_by_engine.items()},
               "noisy_threshold_cores": NOISY_CORES, "window_s": WINDOW_S}
        if not quiet:
            why = []
            if self.noisy:
                why.append(f"another process used more than {NOISY_CORES} of a core in {self.noisy} of "
                           f"{self.windows} windows of {WINDOW_S} s (up to {self.worst:.2f} cores)")
            if steal_fraction is not None and steal_fraction > STEAL_FRACTION:
                why.append(f"the hypervisor stole {100 * steal_fraction:.1f}% of the CPU time")
            out["warning"] = "the machine was not quiet: " + "; ".join(why)
        return out
