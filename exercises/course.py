# Generated from solutions/course.py by tools/make_exercises.py: edit that file, not this one.
"""The course's helpers: ``hint(name, level)``, ``predict(...)``, puzzle scores.

They live once, in ``solutions/course.py`` (no answers in them to blank out); this module
gives them to lessons under the ``exercises`` package.
"""

from solutions.course import LEVELS, hint, predict, score_layout, score_schedule  # noqa: F401
