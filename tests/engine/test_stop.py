from dsv4.sampling_params import SamplingParams
from dsv4.text.stop import StopChecker, StopResult

EOS = 1


def run_tokens(checker, pieces):
    """Feed (token_id, text piece) pairs one at a time, as the engine would; return the
    first StopResult and how many tokens had been appended when it came."""
    ids, text = [], ""
    for token, piece in pieces:
        ids.append(token)
        text += piece
        result = checker.check(ids, text, len(piece))
        if result is not None:
            return result, len(ids)
    return None, len(ids)


def test_eos_stops_with_no_stop_reason():
    checker = StopChecker(SamplingParams(), EOS)
    assert checker.check([5, 6]) is None
    assert checker.check([5, 6, EOS]) == StopResult("stop", None, None)


def test_ignore_eos_keeps_going():
    checker = StopChecker(SamplingParams(ignore_eos=True), EOS)
    assert checker.check([5, EOS]) is None


def test_eos_not_before_min_tokens():
    checker = StopChecker(SamplingParams(min_tokens=2), EOS)
    assert checker.check([EOS]) is None
    assert checker.check([5, EOS]) is None
    assert checker.check([5, 6, EOS]).finish_reason == "stop"


def test_stop_token_ids_report_the_token():
    checker = StopChecker(SamplingParams(stop_token_ids=[7, 9]), EOS)
    assert checker.check([5, 9], "ab", 1) == StopResult("stop", 9, "ab")


def test_max_tokens_is_length():
    checker = StopChecker(SamplingParams(max_tokens=3), EOS)
    assert checker.check([5, 6]) is None
    assert checker.check([5, 6, 7]) == StopResult("length", None, None)


def test_eos_on_the_last_allowed_token_is_stop_not_length():
    checker = StopChecker(SamplingParams(max_tokens=2), EOS)
    assert checker.check([5, EOS]).finish_reason == "stop"


def test_model_length_is_length():
    checker = StopChecker(SamplingParams(max_tokens=100), EOS, prompt_len=10, max_model_len=12)
    assert checker.check([5]) is None
    assert checker.check([5, 6]).finish_reason == "length"


def test_stop_string_spanning_token_boundaries():
    checker = StopChecker(SamplingParams(stop=["END"]), EOS)
    result, n = run_tokens(checker, [(10, "hello E"), (11, "N"), (12, "D of"), (13, "x")])
    assert n == 3
    assert result == StopResult("stop", "END", "hello ")


def test_stop_string_included_in_output():
    checker = StopChecker(SamplingParams(stop=["END"], include_stop_str_in_output=True), EOS)
    result, _ = run_tokens(checker, [(10, "hello E"), (11, "ND tail")])
    assert result == StopResult("stop", "END", "hello END")


def test_earliest_stop_string_wins():
    checker = StopChecker(SamplingParams(stop=["cd", "bc"]), EOS)
    result, _ = run_tokens(checker, [(10, "a"), (11, "bcd")])
    assert result == StopResult("stop", "bc", "a")


def test_stop_string_searched_in_whole_text_without_new_text_len():
    checker = StopChecker(SamplingParams(stop=["xy"]), EOS)
    assert checker.check([3, 4], "axyb") == StopResult("stop", "xy", "a")


def test_stop_string_ignored_until_min_tokens():
    # "e" appears in the 2nd token, but only counts from the 4th token on; the window of a
    # later token does not look back at text that was complete before it.
    checker = StopChecker(SamplingParams(stop=["e"], min_tokens=3), EOS)
    result, n = run_tokens(checker, [(10, " is"), (11, " Lee"), (12, ","), (13, " a"),
                                     (14, " stud"), (15, "ent")])
    assert n == 6
    assert result == StopResult("stop", "e", " is Lee, a stud")


def test_stream_holdback():
    assert StopChecker(SamplingParams(), EOS).stream_holdback_chars == 0
    assert StopChecker(SamplingParams(stop=["a", "abcd"]), EOS).stream_holdback_chars == 3
    included = SamplingParams(stop=["abcd"], include_stop_str_in_output=True)
    assert StopChecker(included, EOS).stream_holdback_chars == 0
