/* Prompt lookup's matching (drafters/lookup.py), one row at a time.
 *
 * Row b holds length[b] tokens of hist[b, :]. Its match length is the longest n <= n_max such that its last n tokens
 * also occur ending at an earlier position i < length - 1 (so that something follows them); end[b] is the latest
 * such i. With no occurrence at all, match[b] = 0 and end[b] is the last position looked at (unused by the caller).
 * The scan is O(length x the run at each position): microseconds, where the tensor version costs ~0.3 ms a round. */

void lookup_match(const long *hist, const long *length, long rows, long width, long n_max, long *match, long *end)
{
    for (long b = 0; b < rows; b++) {
        const long *h = hist + b * width;
        long len = length[b], best = 0, at = -1;
        for (long i = 0; i < len - 1; i++) {
            long r = 0;
            while (r < n_max && r <= i && h[i - r] == h[len - 1 - r])
                r++;
            if (r >= best) { /* the latest occurrence of the longest run */
                best = r;
                at = i;
            }
        }
        match[b] = best;
        end[b] = at;
    }
}
