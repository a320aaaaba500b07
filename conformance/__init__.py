"""kvlayout conformance: generated cases, checked against ``kvlayout.reference``.

``strategies`` holds the hypothesis strategies and case builders (numpy only,
no torch), shared by the pytest suite and the conformance runner.
"""
