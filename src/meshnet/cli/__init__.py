"""The ``meshnet`` command: the composition root that turns flags into frozen configs."""
