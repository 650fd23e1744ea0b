/*
 * Loads the plugin named by argv[1] with dlopen(RTLD_NOW | RTLD_LOCAL), as an application
 * loads a transport plugin, and runs it. Links only libdl: libibverbs comes in with the
 * plugin. Exits 0 when the plugin made a completion channel on at least one device.
 */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: dlopen_main PLUGIN\n");
        return 2;
    }
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    int (*run)(void) = (int (*)(void))dlsym(h, "plugin_run");
    return run && run() > 0 ? 0 : 1;
}
