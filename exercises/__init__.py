# Generated from solutions/__init__.py by tools/make_exercises.py: edit that file, not this one.
"""The course's exercises, one module per lesson, importable so that launched ranks can
run them.

``solutions/`` holds them with the answers in place, between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` markers; it is the single source. ``tools/make_exercises.py`` (``make
exercises``) generates ``exercises/`` from it, where each marked block becomes a blank
that raises ``NotImplementedError`` with a hint. Learners fill in ``exercises/``; authors
edit ``solutions/`` only. ``check.py`` and ``checks/`` (the checker) are copied as they are.
"""
