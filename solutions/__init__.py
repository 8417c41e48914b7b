"""Reference solutions: the single source of every exercise.

Each module here is a lesson's exercise with the answers between ``### BEGIN SOLUTION``
and ``### END SOLUTION`` markers. ``tools/make_exercises.py`` (``make exercises``)
turns this package into ``exercises/``, where the marked blocks become blanks that
raise ``NotImplementedError`` with a hint. Edit solutions here, never in exercises/.
``check.py`` and ``checks/`` hold the checker, copied unchanged.
"""
