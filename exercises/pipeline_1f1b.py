# Your copy of this exercise, generated from solutions/pipeline_1f1b.py by tools/make_exercises.py.
# Fill in the blanks (each raises NotImplementedError), then check your work with
#     from exercises.check import check; check("pipeline_1f1b")
"""Lesson 04 exercise: write the 1F1B pipeline schedule as data.

A pipeline of ``pp`` ranks holds one stage of the model each. A *schedule* says, for
every rank, in which order to run the forward (``F``) and backward (``B``) of each of
the ``m`` micro-batches. ``minipar.parallel.schedules`` writes it as one list of
``Action(kind, mb, chunk)`` per rank; with one stage per rank, ``chunk`` is the rank.

GPipe (Huang et al., arXiv 1811.06965) runs every forward, then every backward: rank 0
keeps the activations of all m micro-batches until their backward. 1F1B
(PipeDream-Flush, Narayanan et al., arXiv 2006.09503 and 2104.04473) starts the
backward of a micro-batch as soon as possible:

1. warm-up: rank r runs ``pp - r - 1`` forwards (never more than m);
2. steady state: alternate one forward (the next micro-batch) and one backward (the
   oldest micro-batch still held), until every forward has run;
3. cool-down: the backwards that are left, oldest first.

The idle time is the same as GPipe's, (p-1)/(m+p-1) of the step with t_B = 2 t_F, but
rank r never holds more than ``min(m, pp - r)`` micro-batches instead of m.

You write the compute order (``one_f_one_b_compute``); ``with_communication`` (given,
from ``minipar.parallel.schedules``) inserts the ``SEND``/``RECV`` actions so that the
lists run without deadlock. Then ``one_f_one_b`` returns lists the real executor runs,
and ``peak_in_flight`` counts what each rank holds at most.
"""

from __future__ import annotations

from minipar.parallel.schedules import Action, Schedule, with_communication


def one_f_one_b_compute(pp: int, microbatches: int) -> Schedule:
    """Per rank, the F and B actions of 1F1B in the order the rank runs them.

    Returns ``pp`` lists; list r holds ``Action("F", i, r)`` and ``Action("B", i, r)``
    for every micro-batch i (2 m actions) and nothing else.
    """
    # YOUR CODE HERE
    raise NotImplementedError(
        'one_f_one_b_compute in exercises/pipeline_1f1b.py is not implemented '
        "yet. Hint: ask for one with hint('pipeline_1f1b', 1) (a nudge), 2 (the "
        'idea) or 3 (the formula), from exercises.course')


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """The runnable 1F1B schedule: the compute order with its sends and receives."""
    return with_communication(one_f_one_b_compute(pp, microbatches))


def peak_in_flight(actions: Schedule) -> list[int]:
    """Per rank, the most micro-batches whose F has run and whose B has not yet run.

    That count times one micro-batch's activations (for this rank's layers) is the
    activation memory the rank needs. Ignore the SEND/RECV actions.
    """
    # YOUR CODE HERE
    raise NotImplementedError(
        'peak_in_flight in exercises/pipeline_1f1b.py is not implemented yet. '
        "Hint: ask for one with hint('pipeline_1f1b', 1) (a nudge), 2 (the idea) "
        'or 3 (the formula), from exercises.course')


def bubble_fraction(pp: int, microbatches: int) -> float:
    """The idle share of a 1F1B step, with a backward twice as long as a forward."""
    # YOUR CODE HERE
    raise NotImplementedError(
        'bubble_fraction in exercises/pipeline_1f1b.py is not implemented yet. '
        "Hint: ask for one with hint('pipeline_1f1b', 1) (a nudge), 2 (the idea) "
        'or 3 (the formula), from exercises.course')
