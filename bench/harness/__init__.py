"""What every benchmark shares around its measurement: the services it runs against, worker and
gateway processes, meters, statistics, the machine it ran on and how its report is written."""
