"""The stages of the feature draft's trainer (``training/train_feature_draft.py``): its data
(``data``: the target, the cached corpus chunks, the target's features over them and the
plain-text openings) and the draft's training, replay and export (``train``)."""
