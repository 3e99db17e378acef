"""``launcher report JOB``: one self-contained HTML page of a job, made with plotly (``page``), from
what the job record and the run dir hold (``facts``); of a sweep, from ``launcher.sweep.table``'s."""
