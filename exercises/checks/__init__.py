# Generated from solutions/checks/__init__.py by tools/make_exercises.py: edit that file, not this one.
"""The cases of each exercise's check: ``checks/<exercise>.py`` defines ``run(impl, timeout)``."""
