// The per-header translation units are compiled (and linked) with this main; building them is
// the test.
int main() { return 0; }
