/*
 * Bind the shim's imports to the oldest glibc symbol versions so that a build
 * on glibc >= 2.34 still loads into containers with an older glibc (2.17+).
 *
 * glibc 2.34 moved libdl and libpthread into libc and gave the moved symbols
 * a new default version (GLIBC_2.34). A plain build would import e.g.
 * dlvsym@GLIBC_2.34 and fail to load on Ubuntu 20.04 (glibc 2.31). The old
 * versions stay available in new glibc, so pinning them costs nothing. The
 * Makefile also links libdl.so.2 and libpthread.so.0 explicitly so that on old
 * glibc the definitions are found there.
 *
 * A test runs objdump -T on the built library and fails if any import needs
 * a version newer than GLIBC_2.17.
 */
#ifndef DILU_GLIBC_COMPAT_H
#define DILU_GLIBC_COMPAT_H

#if defined(__x86_64__)
#define DILU_GLIBC_BASE "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define DILU_GLIBC_BASE "GLIBC_2.17"
#endif

#ifdef DILU_GLIBC_BASE
#define DILU_PIN(sym) __asm__(".symver " #sym "," #sym "@" DILU_GLIBC_BASE)
DILU_PIN(dlopen);
DILU_PIN(dlerror);
DILU_PIN(dlvsym);
DILU_PIN(dladdr);
DILU_PIN(pthread_create);
DILU_PIN(pthread_detach);
DILU_PIN(pthread_once);
DILU_PIN(pthread_key_create);
DILU_PIN(pthread_setspecific);
DILU_PIN(pthread_sigmask);
DILU_PIN(pthread_attr_init);
DILU_PIN(pthread_attr_destroy);
DILU_PIN(pthread_attr_setdetachstate);
DILU_PIN(pthread_attr_setstacksize);
DILU_PIN(pthread_mutex_lock);
DILU_PIN(pthread_mutex_unlock);
DILU_PIN(pthread_mutex_init);
DILU_PIN(pthread_mutex_trylock);
#endif

#endif /* DILU_GLIBC_COMPAT_H */
