"""How long a step takes for how much work, learned from the steps run: the scheduler's step time budget.

Sarathi-Serve (Agrawal et al., OSDI 2024, sec. 4.3) picks the token budget of a step from a latency target,
by profiling the model offline. Here the engine learns it while serving, so the same target holds on a 2-core
CPU and on a GPU, for any model: each step's wall time is fitted against its work with an exponentially
weighted least-squares line, ``seconds = base + per_unit * work``, where ``work`` counts the step's scheduled
tokens plus one per request that samples (the LM head and the sampler, per row). ``base`` is what a step costs
whatever it holds (reading the weights at small batch, the step's fixed overhead).
"""

from __future__ import annotations

# Weight of the newest step in the fit: the last ~20 steps dominate, so the fit follows a change of load
# (another process on the CPU, a longer context) within a second or two of steps.
DECAY = 0.95


class StepCost:
    """An online fit of step seconds against step work (tokens + sampling rows).

    Until two steps of different work have been seen, the line goes through the origin (``per_unit`` =
    seconds / work), which errs towards smaller budgets.
    """

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self.num_steps = 0  # steps observed (the fit weighs about the last 1 / (1 - DECAY) of them)

    def observe(self, work: int, seconds: float) -> None:
        """One step: ``work`` units (tokens + sampling rows) took ``seconds`` of wall time."""
        if work <= 0 or seconds <= 0:
            return
        self.num_steps += 1
        d = DECAY
        self._n = d * self._n + 1.0
        self._x = d * self._x + work
        self._y = d * self._y + seconds
        self._xx = d * self._xx + work * work
        self._xy = d * self._xy + work * seconds

    def line(self) -> tuple[float, float] | None:
        """``(base_seconds, seconds_per_unit)``, both non-negative, or None before the first step."""
        if self._n == 0:
            return None
        var = self._n * self._xx - self._x * self._x
        if var <= 1e-9 * self._n * self._xx:  # every step had the same work: no slope to fit
            return 0.0, self._y / self._x
        slope = (self._n * self._xy - self._x * self._y) / var
        base = (self._y - slope * self._x) / self._n
        if slope <= 0 or base < 0:  # noise: fall back to the line through the origin
            return 0.0, self._y / self._x
        return base, slope

    def units_within(self, seconds: float, committed_work: int) -> int | None:
        """How many more work units fit in a step of ``seconds`` that already holds ``committed_work`` units
        (0 when it is already over), or None before the first step has been observed (no estimate yet)."""
        line = self.line()
        if line is None:
            return None
        base, per_unit = line
        return max(0, int((seconds - base) / per_unit) - committed_work)
