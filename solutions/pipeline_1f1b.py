"""Lesson 05 exercise: write the 1F1B pipeline schedule as data.

A pipeline of ``pp`` ranks holds one stage of the model each. A *schedule* says, for
every rank, in which order to run the forward (``F``) and backward (``B``) of each of
the ``m`` micro-batches. ``minipar.parallel.schedules`` writes it as one list of
``Action(kind, mb, chunk)`` per rank; with one stage per rank, ``chunk`` is the rank.

GPipe (Huang et al., arXiv 1811.06965) runs every forward, then every backward, so
rank 0 keeps the activations of all m micro-batches at once. 1F1B (PipeDream-Flush,
Narayanan et al., arXiv 2006.09503 and 2104.04473) keeps the same step time but starts
each micro-batch's backward as early as the pipeline allows, so that a rank holds far
fewer micro-batches. Working out when "as early as possible" is, rank by rank, is the
exercise: lesson 05's timelines and ``hint("pipeline_1f1b", 1)`` help.

You write the compute order (``one_f_one_b_compute``), the peak count of micro-batches
a rank holds (``peak_in_flight``) and the idle share of the step (``bubble_fraction``,
in closed form); ``with_communication`` (given, from ``minipar.parallel.schedules``)
inserts the ``SEND``/``RECV`` actions so that the lists run without deadlock.

What the check tests, for pp 1..4 and m 1..7: each rank runs each F and B exactly once
and only its own; the runnable lists pass ``schedules.validate`` (no deadlock, every F
before its B, every message matched); the simulated step has the same idle time as
GPipe's and as your closed form; each rank's peak is below GPipe's wherever a smaller
one is possible, and equal to ``minipar``'s own 1F1B. Then your lists drive the real
executor on 2 ranks, and the loss and gradients must equal one process on the whole
batch.
"""

from __future__ import annotations

from minipar.parallel.schedules import Action, Schedule, with_communication


def one_f_one_b_compute(pp: int, microbatches: int) -> Schedule:
    """Per rank, the F and B actions of 1F1B in the order the rank runs them.

    Returns ``pp`` lists; list r holds ``Action("F", i, r)`` and ``Action("B", i, r)``
    for every micro-batch i (2 m actions) and nothing else.
    """
    ### BEGIN SOLUTION
    # HINT: for rank r, warm = min(pp - r - 1, microbatches) forwards F0..F(warm-1);
    # then for i in range(microbatches - warm): F(warm + i) followed by B(i);
    # then the remaining backwards B(microbatches - warm) .. B(microbatches - 1).
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, microbatches)
        acts = [Action("F", i, r) for i in range(warm)]
        for i in range(microbatches - warm):
            acts += [Action("F", warm + i, r), Action("B", i, r)]
        acts += [Action("B", i, r) for i in range(microbatches - warm, microbatches)]
        out.append(acts)
    return out
    ### END SOLUTION


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """The runnable 1F1B schedule: the compute order with its sends and receives."""
    return with_communication(one_f_one_b_compute(pp, microbatches))


def peak_in_flight(actions: Schedule) -> list[int]:
    """Per rank, the most micro-batches whose F has run and whose B has not yet run.

    That count times one micro-batch's activations (for this rank's layers) is the
    activation memory the rank needs. Ignore the SEND/RECV actions.
    """
    ### BEGIN SOLUTION
    # HINT: walk each rank's list with a counter: +1 at every "F", -1 at every "B";
    # keep the largest value it reaches.
    peaks = []
    for acts in actions:
        held = peak = 0
        for a in acts:
            if a.kind == "F":
                held += 1
            elif a.kind == "B":
                held -= 1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
    ### END SOLUTION


def bubble_fraction(pp: int, microbatches: int) -> float:
    """The idle share of a 1F1B step (idle time over the step's time, any rank), with a
    backward twice as long as a forward and no time for messages."""
    ### BEGIN SOLUTION
    # HINT: the step lasts (m + p - 1) forward-and-backward slots, of which each rank is
    # busy during m: the idle share is (p - 1) / (m + p - 1).
    return (pp - 1) / (microbatches + pp - 1)
    ### END SOLUTION
