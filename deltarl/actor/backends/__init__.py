"""Generation backends behind one small interface (:mod:`deltarl.actor.backends.base`)."""
