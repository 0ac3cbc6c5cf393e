"""Reward files the data, reward and launcher tests write: a good function with dict extras, a lenient one, and one
of each failure (raises, None, NaN, hangs, wrong signature, not a function)."""

REWARDS = '''
import math, os, time
def good(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == str(ground_truth)), "length": len(solution_str)}
def lenient(data_source, solution_str, ground_truth, extra_info=None):
    return float(str(ground_truth) in solution_str)
def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("boom")
def none(data_source, solution_str, ground_truth, extra_info=None):
    return None
def nan(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan
def hangs(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(60)
def hangs_on_wait(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "wait":
        time.sleep(600)
    return {"score": float(solution_str == str(ground_truth)), "pid": os.getpid()}
def two_args(solution_str, ground_truth):
    return 0.0
NOT_A_FUNCTION = 3
'''
