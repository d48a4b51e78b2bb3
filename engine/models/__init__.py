"""Classifiers behind one small interface (see `base.Classifier`)."""
