"""Offline calibration a method needs before it runs (`python -m kvbench calibrate <method>`): DuoAttention's
retrieval-head gates (`kvbench.calibration.duoattention`)."""
