# Generated from solutions/course.py by tools/make_exercises.py: edit that file, not this one.
"""The course's helpers: ``hint``, ``predict``, puzzle scores, and the checks of
what the lessons' runs show.

They live once, in ``solutions/course.py`` (no answers in them to blank out); this module
gives them (its ``__all__``) to lessons under the ``exercises`` package.
"""

from solutions.course import *  # noqa: F403
from solutions.course import __all__  # noqa: F401
