"""Stage 4: summary tables, the trust panel and the plots."""
