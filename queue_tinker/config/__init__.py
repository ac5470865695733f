"""Each part's configuration, one frozen model a part: the fields of the settings.

queue_tinker/settings.py reads every field of every part from its QT_<NAME> variable at once;
a process hands the settings whole to each part, typed as that part's config here, and the part
reads the fields it needs. A new knob is a field here and the code that reads it, nothing
between. The engines take an EngineConfig and never read the environment themselves, so a test
builds one with the fields it wants.
"""
