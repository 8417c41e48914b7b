"""The cases of each exercise's check: ``checks/<exercise>.py`` defines ``run(impl, timeout)``."""
