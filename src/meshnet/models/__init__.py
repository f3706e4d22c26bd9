"""Model families: which architectures a layer-split route serves correctly (``families``)."""
