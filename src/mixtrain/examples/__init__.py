"""Built-in examples on real data that ships with installed packages or Python itself (no downloads).

mixtrain train digits     # a CNN on scikit-learn's handwritten digits (vision)
mixtrain train chars      # a character-level transformer on Python's own documentation (language)
mixtrain train chars-large --shard-optimizer   # the same text, 25M parameters: the big-model memory recipe
mixtrain train mnist --data-dir DIR   # a CNN on MNIST IDX files you already have
"""
